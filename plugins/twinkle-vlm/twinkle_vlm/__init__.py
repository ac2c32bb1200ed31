"""Twinkle task plugin: vision-language model training (the ``vlm`` task)."""
