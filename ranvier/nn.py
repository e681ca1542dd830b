"""Myelin's network cells, built with Myelin's builder calls: a feed-forward stack (FF)
and an LSTM whose state flows between steps through channels.

The attribute names (`weights`, `biases`, `hidden_out`, `output`; `x2i`, `h2i`, ...,
`ct`, `ht`, `cnx_control`, `cnx_hidden`) are Myelin's, so code that fills or reads the
variables of a Myelin cell works unchanged. Parameters are function variables without
data: set them on an instance, or give them data (`set_layer_data`) to make them constants.
"""

from __future__ import annotations

from .flow.builder import Builder, Tensor


class FF:
    """Layers of x·W + b, each but the last followed by `activation` (an op type), reading
    a [1, d] (or [batch, d]) input; layer `hidden` is exposed as a reference output."""

    def __init__(self, tf: Builder, input: Tensor, layers: list[int], hidden: int | None = None,
                 bias: bool = True, activation: str = "Relu"):
        self.weights: list[Tensor] = []
        self.biases: list[Tensor] = []
        self.hidden_out: Tensor | None = None
        v = input
        for index, width in enumerate(layers):
            weight = tf.var(f"W{index}", v.type, [v.shape[1], width])
            self.weights.append(weight)
            v = tf.matmul(v, weight)
            if bias:
                offset = tf.var(f"b{index}", v.type, [1, width])
                self.biases.append(offset)
                v = tf.add(v, offset)
            if index == hidden or index != len(layers) - 1:
                v = tf.op(activation, [v])
            if index == hidden:
                v = tf.identity(v, name="hidden")
                v.ref = v.input = v.output = True
                self.hidden_out = v
        self.output = tf.identity(v, name="output")

    def set_layer_data(self, index: int, weight, bias=None) -> None:
        """Make layer `index`'s weight (and bias) constants with these values."""
        if not 0 <= index < len(self.weights):
            raise IndexError(f"layer {index} of a {len(self.weights)}-layer FF")
        self.weights[index].data = weight
        if bias is not None:
            self.biases[index].data = bias


class LSTM:
    """Myelin's LSTM cell with peepholes and a coupled forget gate (f = 1 − i):

        i = σ(x·x2i + h·h2i + c·c2i + bi)      c' = i ⊙ tanh(x·x2c + h·h2c + bc) + (1 − i) ⊙ c
        o = σ(x·x2o + c'·c2o + h·h2o + bo)     h' = o ⊙ tanh(c')

    `h_in`/`c_in` and `h_out`/`c_out` are reference variables: connect them to elements
    t − 1 and t of the channels of `cnx_hidden` and `cnx_control` to run a sequence."""

    def __init__(self, tf: Builder, input: Tensor, size: int, output_dim: int | None = None):
        dtype, width = input.type, input.shape[1]

        def parameter(name: str, rows: int) -> Tensor:
            return tf.var(name, dtype, [rows, size])

        self.x2i, self.h2i, self.c2i = parameter("x2i", width), parameter("h2i", size), parameter("c2i", size)
        self.bi = parameter("bi", 1)
        self.x2o, self.h2o, self.c2o = parameter("x2o", width), parameter("h2o", size), parameter("c2o", size)
        self.bo = parameter("bo", 1)
        self.x2c, self.h2c = parameter("x2c", width), parameter("h2c", size)
        self.bc = parameter("bc", 1)

        h_in = tf.var("h_in", dtype, [1, size])
        c_in = tf.var("c_in", dtype, [1, size])
        h_in.ref = c_in.ref = True

        affine_i = tf.add(tf.matmul(input, self.x2i),
                          tf.add(tf.matmul(h_in, self.h2i), tf.add(tf.matmul(c_in, self.c2i), self.bi)), name="i_ait")
        i = tf.sigmoid(affine_i, name="i_it")
        forget = tf.sub(1.0, i, name="i_ft")
        write = tf.tanh(tf.add(tf.matmul(input, self.x2c), tf.add(tf.matmul(h_in, self.h2c), self.bc), name="i_awt"),
                        name="i_wt")
        self.ct = tf.add(tf.mul(i, write), tf.mul(forget, c_in), name="c_out")
        self.ct.ref = self.ct.input = self.ct.output = True
        self.cnx_control = tf.cnx("control", [c_in, self.ct])

        affine_o = tf.add(tf.matmul(input, self.x2o),
                          tf.add(tf.matmul(self.ct, self.c2o), tf.add(tf.matmul(h_in, self.h2o), self.bo)), name="i_aot")
        o = tf.sigmoid(affine_o, name="i_ot")
        self.ht = tf.mul(o, tf.tanh(self.ct), name="h_out")
        self.ht.ref = self.ht.input = self.ht.output = True
        self.cnx_hidden = tf.cnx("hidden", [h_in, self.ht])

        if output_dim is not None:
            self.W = tf.var("W", dtype, [size, output_dim])
            self.b = tf.var("b", dtype, [1, output_dim])
