#!/usr/bin/env bash
# EMR bootstrap action (every node): lakeshard's venv, JARs, entrypoints and config,
# from the folder `make artifacts` builds (dist/artifacts: the wheel, constraints.txt,
# jars/*.jar, conf/emr.yaml, entrypoints/*.py), synced to S3 (docs/operations.md).
#   usage: emr-bootstrap.sh s3://my-bucket/lakeshard/artifacts
set -euo pipefail
ARTIFACTS=${1:?usage: emr-bootstrap.sh s3://bucket/prefix}
HOME_DIR=/home/hadoop/lakeshard
mkdir -p "$HOME_DIR"/{jars,entrypoints,conf} /mnt/lakeshard/locks
aws s3 cp --recursive "$ARTIFACTS/" "$HOME_DIR/dist/"
cp "$HOME_DIR"/dist/jars/*.jar "$HOME_DIR/jars/"
cp "$HOME_DIR"/dist/entrypoints/*.py "$HOME_DIR/entrypoints/"
cp "$HOME_DIR"/dist/conf/emr.yaml "$HOME_DIR/conf/"
python3.11 -m venv "$HOME_DIR/venv"
"$HOME_DIR/venv/bin/pip" install --quiet -c "$HOME_DIR/dist/constraints.txt" \
  "$HOME_DIR"/dist/lakeshard-*.whl
