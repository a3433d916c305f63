"""The writer: ``engine.write_shards`` plans a job, encodes each image (OpenCV and Pillow) with a runner (a torch
DataLoader, threads or Apache Beam), stages the shards and commits them with their manifest. No TensorFlow at
import: a DataLoader's workers fork from the writer's process."""
