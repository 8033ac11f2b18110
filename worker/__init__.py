"""arq workers: credit grabs into the ledger (and, later, sweep, refund, reconcile, score bots)."""
