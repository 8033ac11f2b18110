"""The one error of the ``redpacket`` command: something the operator can fix."""

from __future__ import annotations


class OperatorError(Exception):
    """Something the operator can fix; ``main`` prints it as one line and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
