import sys

from gptlite.scaling.sweep import main

if __name__ == "__main__":
    sys.exit(main())
