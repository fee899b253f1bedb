//! The batched input shapes of amp's convolution, pooling and resizing, and their refusals: one message
//! for every layer and op that takes them.

use candle_core::Result;

/// What an input holds after its batch and channel dimensions: one sequence or one image.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Input {
    /// `(batch, channels, length)`.
    Sequence,
    /// `(batch, channels, height, width)`.
    Image,
}

impl Input {
    /// Refuses dims `x` of another rank, naming the layer or op `name`, the shape it takes and the fix
    /// for a single unbatched input.
    pub(crate) fn check_rank(self, name: &str, x: &[usize]) -> Result<()> {
        let (rank, dims, one) = match self {
            Input::Sequence => (3, "(batch, channels, length)", "sequence"),
            Input::Image => (4, "(batch, channels, height, width)", "image"),
        };
        if x.len() != rank {
            candle_core::bail!(
                "{name}: the input must be {dims}, got shape {x:?}; a single {one} is a batch of one: \
                 `.unsqueeze(0)`"
            );
        }
        Ok(())
    }

    /// The dims `x` of an image batch, `[batch, channels, height, width]`, or [`Input::check_rank`]'s
    /// refusal.
    pub(crate) fn image(name: &str, x: &[usize]) -> Result<[usize; 4]> {
        Input::Image.check_rank(name, x)?;
        Ok([x[0], x[1], x[2], x[3]])
    }

    /// [`Input::check_rank`], and refuses an input without the `channels` the layer `layer` reads, in
    /// the layer's own terms (a 1-d layer's op sees its input as 2-d, of height 1).
    pub(crate) fn check(self, layer: &str, x: &[usize], channels: usize) -> Result<()> {
        self.check_rank(layer, x)?;
        if x[1] != channels {
            candle_core::bail!(
                "{layer}: the input has {} channels (shape {x:?}); the layer takes {channels}",
                x[1]
            );
        }
        Ok(())
    }
}
