"""``python -m hyperpar ...`` -- the same as the ``hyperpar`` command."""

from hyperpar.cli import console_main

if __name__ == "__main__":
    console_main()
