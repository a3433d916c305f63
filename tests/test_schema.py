"""The schema: our protobuf-only encoder is wire-identical to TensorFlow's, and parses back."""

import tensorflow as tf

from tfpipe.format import schema
from tfpipe.tf.parse import feature_spec


def tf_example(values):
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[values["image"]])),
        "image_name": tf.train.Feature(bytes_list=tf.train.BytesList(value=[values["image_name"].encode()])),
        "height": tf.train.Feature(int64_list=tf.train.Int64List(value=[values["height"]])),
        "width": tf.train.Feature(int64_list=tf.train.Int64List(value=[values["width"]])),
    }
    if "target" in values:
        feature["target"] = tf.train.Feature(int64_list=tf.train.Int64List(value=values["target"]))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString(deterministic=True)


RECORDS = [
    {"image": b"\xff\xd8abc", "target": [0, 3, 7], "image_name": "a", "height": 5, "width": 7},
    {"image": b"x", "target": [], "image_name": "b", "height": 1, "width": 2},
    {"image": b"y", "image_name": "unlabeled ü", "height": 3, "width": 4},
]


def test_encode_matches_tensorflow_bytes():
    for values in RECORDS:
        assert schema.encode_example(values) == tf_example(values)


def test_parse_with_fixed_len_sequence_feature():
    batch = tf.constant([schema.encode_example(v) for v in RECORDS])
    parsed = tf.io.parse_example(batch, feature_spec())
    assert parsed["target"].numpy().tolist() == [[0, 3, 7], [-1, -1, -1], [-1, -1, -1]]
    assert parsed["image_name"].numpy().tolist() == [b"a", b"b", "unlabeled ü".encode()]
    assert parsed["height"].numpy().tolist() == [5, 1, 3]


def test_decode_without_tensorflow_round_trips():
    decoded = schema.decode_example(schema.encode_example(RECORDS[0]))
    assert decoded["target"] == [0, 3, 7]
    assert decoded["image_name"] == b"a" and decoded["width"] == 7


def test_tfrecord_framing_is_byte_identical_to_tensorflow(tmp_path):
    from tfpipe.format.tfrecord import RecordWriter

    records = [schema.encode_example(v) for v in RECORDS] + [b"", b"x" * 70000]
    with RecordWriter(str(tmp_path / "ours.tfrec")) as w:
        for r in records:
            w.write(r)
    with tf.io.TFRecordWriter(str(tmp_path / "tf.tfrec")) as w:
        for r in records:
            w.write(r)
    assert (tmp_path / "ours.tfrec").read_bytes() == (tmp_path / "tf.tfrec").read_bytes()
    assert [r.numpy() for r in tf.data.TFRecordDataset(str(tmp_path / "ours.tfrec"))] == records
