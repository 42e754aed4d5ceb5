"""Analysis of a pipeline before and after compiling: per-action costs (`costs`), memory
per device predicted from shapes (`memory`) and compile-only targets (`target`), public as
``jaxpipe.costs``, ``jaxpipe.memory`` and ``jaxpipe.target``; beside them the chips they
know (`hardware`) and the reader of compiled programs' HLO text (`hlo`)."""
