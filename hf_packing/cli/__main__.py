"""`python -m hf_packing.cli` = the `hf-packing` command."""

from . import main

if __name__ == "__main__":
    main()
