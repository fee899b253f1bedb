// A half attribute on an array of norms whose length is a const parameter: refused where the struct is
// defined, not at the first use of the model.
use amp::nn::RmsNorm;
use amp::AmpModule;

#[derive(AmpModule)]
pub struct Stack<const L: usize> {
    #[amp(fp16)]
    norms: [RmsNorm; L],
}

fn main() {}
