"""Analysis of a pipeline before and after compiling: per-action costs (`costs`), memory
per device predicted from shapes (`memory`), compile-only targets (`target`) and the
correction of their step times fitted on published runs (`calibration`), public as
``jaxpipe.costs``, ``jaxpipe.memory``, ``jaxpipe.target`` and ``jaxpipe.calibration``;
beside them the chips they know (`hardware`) and the reader of compiled programs' HLO text
(`hlo`)."""
