"""``python -m kvtop.cli`` runs kvctl."""

from kvtop.cli import main

main(prog_name="kvctl")
