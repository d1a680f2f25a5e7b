"""Built-in ACP agents and their registry."""
