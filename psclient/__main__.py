"""`python -m psclient`: the same as the `psclient` command."""

from psclient._cli import main

raise SystemExit(main())
