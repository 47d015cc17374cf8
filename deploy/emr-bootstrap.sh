#!/usr/bin/env bash
# EMR bootstrap action (every node of an emr-spark-8.0.0 cluster): lakeshard's venv,
# JARs, entrypoints and config, from the folder `make artifacts` builds (dist/artifacts:
# the wheel, constraints.txt, jars/*.jar -- Delta 4.0.0 for Spark 4.0 --, conf/emr.yaml,
# entrypoints/*.py), synced to S3 (docs/operations.md, "EMR"). On GPU nodes also the
# devices cgroup YARN's GPU isolation uses (deploy/emr-instance-groups.json).
#   usage: emr-bootstrap.sh s3://my-bucket/lakeshard/artifacts
set -euo pipefail
ARTIFACTS=${1:?usage: emr-bootstrap.sh s3://bucket/prefix}
HOME_DIR=/home/hadoop/lakeshard
mkdir -p "$HOME_DIR"/{jars,entrypoints,conf}
aws s3 cp --recursive "$ARTIFACTS/" "$HOME_DIR/dist/"
cp "$HOME_DIR"/dist/jars/*.jar "$HOME_DIR/jars/"
cp "$HOME_DIR"/dist/entrypoints/*.py "$HOME_DIR/entrypoints/"
cp "$HOME_DIR"/dist/conf/emr.yaml "$HOME_DIR/conf/"
# The release's Python 3.12. pyspark is the cluster's own (spark-submit puts
# /usr/lib/spark/python on the path): the venv gets lakeshard and its caption stack,
# at the exact versions of constraints.txt, and no pyspark or delta-spark.
python3.12 -m venv "$HOME_DIR/venv"
"$HOME_DIR/venv/bin/pip" install --quiet -c "$HOME_DIR/dist/constraints.txt" \
  "$(ls "$HOME_DIR"/dist/lakeshard-*.whl)[caption]"
if command -v nvidia-smi >/dev/null; then
  # YARN's GPU plugin isolates devices through this cgroup (container-executor's
  # cgroups.root, yarn-site's cgroups.mount-path).
  sudo mkdir -p /spark-rapids-cgroup/devices
  sudo mount -t cgroup -o devices cgroupv1-devices /spark-rapids-cgroup/devices
  sudo chmod a+rwx -R /spark-rapids-cgroup
fi
