"""Code shared by Overture's services: config, ids and hashing, wire formats, logging."""
