"""The embedded default job and the `unbroken demo` driver."""
