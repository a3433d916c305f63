"""The shard format, for every reader and writer: the record schema, TFRecord framing, shard names, the manifest,
opening and checking a shard folder, and balanced sampling's class shares. No TensorFlow at import (the writer's
and the PyTorch reader's workers import this package)."""
