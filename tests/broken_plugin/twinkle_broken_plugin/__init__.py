"""A plugin that cannot be imported: Twinkle must report it and carry on without it."""

raise ImportError("twinkle-broken-plugin needs the package 'twinkle_missing_dependency' (pip install it)")
