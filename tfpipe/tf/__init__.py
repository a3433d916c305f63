"""The ``tf.data`` reader: ``read.make_dataset`` opens the shards, reads them in passes, parses and batches the
records and augments them. The one sub-package of ``tfpipe`` that uses TensorFlow (imported when first used, so a
command's ``--help`` answers at once)."""
