"""Config files; `local.yaml` ships inside the package as the embedded default."""
