"""Twinkle's training service: base models hosted for many tenants over HTTP."""
