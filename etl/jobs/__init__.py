"""Jobs: read, call transforms, write, record stats."""
