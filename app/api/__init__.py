"""The HTTP API: ``create_app``, authentication, body limits, schemas, routes."""
