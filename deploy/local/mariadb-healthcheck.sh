#!/bin/sh
# healthcheck.sh --connect --innodb_initialized, as the official image's: the server answers on its
# socket and InnoDB is up (the options are taken as that pair; the stack asks nothing else).
exec mariadb --user=mysql -Nse "SELECT 1 FROM information_schema.ENGINES WHERE ENGINE='InnoDB' AND SUPPORT IN ('YES','DEFAULT')" 2>/dev/null | grep -q 1
