"""`python -m zlm` runs the command-line app."""

from zlm.cli import main

if __name__ == "__main__":
    main()
