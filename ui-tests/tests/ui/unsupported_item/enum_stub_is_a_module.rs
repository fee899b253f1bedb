// After the enum error, the stub impl keeps the rest of the code free of follow-on errors.
use amp::AmpModule;

#[derive(AmpModule)]
enum Head {
    Linear(amp::nn::Linear),
}

fn train<M: AmpModule>(_model: &M) {}

fn main() {
    let head: Option<Head> = None;
    if let Some(head) = &head {
        train(head);
    }
}
