"""The extras: what fsdp_compose offers beyond torch's FSDP2, outside the core.

``observe/`` (``explain``, ``estimate``), ``plan/`` (``plan``: a sharding that fits a budget), the checkpoint files (``save_checkpoint``, ``load_checkpoint``) and the
quantized all-gather (``quantize_all_gather``). They use only the core's public names and ``fsdp_compose.extras_api``;
the core never imports them: ``fsdp_compose`` resolves their public names at first use
(``tests/meta/test_architecture.py`` checks both directions).
"""
