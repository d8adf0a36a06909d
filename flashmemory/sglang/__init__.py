"""FlashMemory inside sglang 0.5.23: an entry-point plugin (`plugin.register`) that hooks DeepSeek-V4.

Importing this package does not import sglang; only `plugin.register()` and the hook modules do.
"""
