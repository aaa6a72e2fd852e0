"""Overture's services: scheduler, nodemgr, engine, kvstore."""
