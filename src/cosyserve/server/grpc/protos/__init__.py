"""The protos and their generated stubs (regenerate with ``scripts/gen_protos``)."""
