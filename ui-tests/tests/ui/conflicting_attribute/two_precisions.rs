// Two different precisions on one field are refused: a field computes in one precision.
use amp::AmpModule;

#[derive(AmpModule)]
struct Block {
    #[amp(fp16, fp32)]
    fc: amp::nn::Linear,
}

fn main() {}
