"""The `unbroken` command."""
