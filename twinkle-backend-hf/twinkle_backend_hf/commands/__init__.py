"""The ``twinkle`` commands that load checkpoints with transformers and peft: ``chat``, ``export`` and ``eval``.

Registered by this distribution's plugin (``twinkle_register_commands``); each module imports transformers,
peft and torch inside its command's ``run`` only, so ``twinkle --help`` stays fast.
"""
