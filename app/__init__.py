"""Homefleet's server side: settings, journal, registry, storage, HTTP API and CLI."""
