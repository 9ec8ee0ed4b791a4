"""Horovod's package name for ringwatch (see compat/README.md): names only."""
