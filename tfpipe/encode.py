"""One image to one serialized record: the per-image work of every writer runner.

A leaf: it needs only the image codec (``tfpipe.images``), the schema and the
file layer, so the DataLoader workers (``tfpipe.write``) and Beam's workers
(``tfpipe.beam``) import it without the orchestration, pandas or TFDS.
"""
from tfpipe import fs, schema
from tfpipe.errors import TfpipeError
from tfpipe.images import prepare_image


def encode_item(item, target, spec):
    """One image to one serialized record: read, decode, resize, encode, serialize.

    Returns (record, None), or (None, error message) for a problem with the
    user's data, so the caller applies the error policy (stop, or skip and
    report) in input order. Used by the DataLoader workers and the Beam runner.
    """
    try:
        if item.data is not None:  # e.g. from TFDS
            data = item.data
        else:
            with fs.open(item.path, "rb") as f:
                data = f.read()
        image, height, width, _ = prepare_image(data, spec, item.path)
    except TfpipeError as e:
        return None, str(e)
    except OSError as e:
        return None, f"{item.path}: cannot read ({e.strerror or e})"
    except Exception as e:  # tf.errors.* from tf.io.gfile for remote inputs
        if not type(e).__module__.startswith("tensorflow"):
            raise
        return None, f"{item.path}: cannot read ({type(e).__name__})"
    values = {schema.IMAGE: image, schema.IMAGE_NAME: item.name, schema.HEIGHT: height, schema.WIDTH: width}
    if target is not None:
        values[schema.TARGET] = target
    return schema.encode_example(values), None
