"""A local stand-in for the production topology (``scripts/stack``): real servers in network namespaces."""
