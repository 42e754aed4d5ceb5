"""What jaxpipe reads and rewrites of JAX's jaxprs: the equation readers (`equations`), the
residual analysis of a stage's vjp (`residuals`) and the backward split into B and W
(`split`). The only code that reads equation parameters or knows how a JAX release spells
them."""
