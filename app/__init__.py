"""The chatgate gateway: Starlette app, settings and CLI. Imports nothing heavy at package import."""
