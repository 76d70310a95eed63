/* The project's CPU kernels as one translation unit (fusion/forward/native_kernels.py builds this file): each file's
 * helpers stay static and the later files use the earlier ones'. */

#include "quantized_mm.c" /* the quantized products */
#include "decoder_step.c" /* a decode step's layers */
#include "logit_rows.c"   /* the route rule's passes over the vocabulary */
