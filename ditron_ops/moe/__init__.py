"""Expert-parallel token exchange (``moe_dispatch`` / ``moe_combine``): not yet implemented."""

__all__: list[str] = []
