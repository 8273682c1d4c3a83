"""How the API's schema (drf-spectacular) describes the staff's hashed API tokens."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    # Registered by being defined (accounts.apps imports this module): without it the schema
    # leaves the API's one authentication out, and `check --deploy` warns (drf_spectacular.W001).
    target_class = "accounts.authentication.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "`Token KEY`: a staff member's API token (`manage.py api_token USER`), stored hashed, expiring",
        }
