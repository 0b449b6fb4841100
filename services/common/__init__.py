"""Plumbing shared by the worker services: engine thread, configuration, protobuf edge."""
