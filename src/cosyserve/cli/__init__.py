"""The ``cosyserve`` command line: one module per command group; :mod:`cosyserve.cli.main` joins them."""
