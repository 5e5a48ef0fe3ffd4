"""``python -m minisgl``: see ``python -m minisgl --help``."""

from minisgl.server.launcher import main

if __name__ == "__main__":
    raise SystemExit(main())
