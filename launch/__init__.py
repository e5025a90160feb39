"""Launcher helpers: `hybridsync-run` (installed as the package hybridsync_launch)."""
