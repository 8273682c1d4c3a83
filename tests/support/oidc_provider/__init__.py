"""A real OpenID Connect provider for the sign-in tests: django-oauth-toolkit with OIDC on, in a process of its own.

A tiny Django project of its own (settings.py, urls.py), nothing of llmgw's: its own SQLite
database, RSA key and cookies. `start.py` starts it under gunicorn on a free loopback port;
`manage provider_state` (the command in management/) sets its client, users and groups, as
the organisation's identity team would in theirs.
"""
