"""Pure planning functions; the public names are re-exported by `loader.plan`."""
