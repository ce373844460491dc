"""Imported last by the fork server (``rlsys.fork_server.READY``), after everything it preloads: moves those
objects out of the garbage collector's reach (``gc.freeze``). A forked process then never walks them: the first
full collection in a fork (megatron runs one in every checkpoint save) wrote to every inherited object's header,
copying the server's whole heap page by page (3 s of a tiny model's first save, measured)."""

import gc

gc.collect()
gc.freeze()
