"""Hook functions of (state, module, args): forward in ``forward``, backward in ``backward``."""
