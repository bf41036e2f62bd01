"""The operators' web console at ``/console`` (api/console/routes.py)."""
