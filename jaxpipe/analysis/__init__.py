"""Analysis of a pipeline before and after compiling: per-action costs (`costs`), memory
per device predicted from shapes (`memory`), compile-only targets (`target`) and the
correction of their step times fitted on published runs (`calibration`) and the time of a
fused attention kernel, which no compiler's estimate sees (`kernels`), public as
``jaxpipe.costs``, ``jaxpipe.memory``, ``jaxpipe.target``, ``jaxpipe.calibration`` and
``jaxpipe.kernels``;
beside them the chips they know (`hardware`) and the reader of compiled programs' HLO text
(`hlo`)."""
