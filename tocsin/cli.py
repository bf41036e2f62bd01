"""The ``tocsin`` command line (placeholder; filled in below)."""

def main() -> int:
    return 0
